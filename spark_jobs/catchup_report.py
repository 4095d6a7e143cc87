"""Entry script for ``spark-submit``: the catch-up report, unchanged on any master.

    spark-submit --master spark://HOST:7077 --jars /usr/share/java/postgresql.jar \
        --driver-class-path /usr/share/java/postgresql.jar \
        spark_jobs/catchup_report.py --jdbc-url postgresql://... --out reports/

The master comes from spark-submit; every other option is the same as for
``python -m spark_jobs.catch_up``. Tributary must be importable by the driver
(``pip install -e .`` or ``--py-files``); the executors run no Python of ours.
"""

# tests: tests/spark/test_catch_up_report.py

import os
import sys

if __package__ in (None, ""):
    # Run as a file: make the repository (this file's parent's parent) importable.
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from spark_jobs.catch_up.job import main  # noqa: E402

if __name__ == "__main__":
    main()
