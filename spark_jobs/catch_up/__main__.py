"""``python -m spark_jobs.catch_up``: the catch-up report's command line."""

# tests: tests/spark/test_catch_up_report.py

from spark_jobs.catch_up.job import main

if __name__ == "__main__":
    main()
