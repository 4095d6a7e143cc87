"""The catch-up report: which destinations are behind, by how much, since when, and what catching them up costs.

``job.py`` reads the live tables over JDBC, runs the pure DataFrame steps of
``transforms.py`` and writes Parquet, CSV, PNG charts and ``report.html``
(``report.py``). Run it with ``python -m spark_jobs.catch_up`` or
``spark-submit spark_jobs/catchup_report.py``; docs/spark-reports.md says how.
"""
