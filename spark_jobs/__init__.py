"""PySpark jobs over the live Tributary tables, one package per job (see docs/spark-reports.md)."""
