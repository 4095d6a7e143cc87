#!/usr/bin/env bash
# Make sure the Spark reports can run: a Java runtime and the PostgreSQL JDBC
# driver jar from Debian's package. Installs only what is missing (apt, as
# root); prints where each one is. Called by `make test` before the Spark tests.
set -euo pipefail

JDBC_JAR=${TRIBUTARY_JDBC_JAR:-/usr/share/java/postgresql.jar}
missing=()

if ! command -v java >/dev/null 2>&1; then
    missing+=(default-jre-headless)
fi
if [ ! -r "$JDBC_JAR" ]; then
    missing+=(libpostgresql-jdbc-java)
fi

if [ "${#missing[@]}" -gt 0 ]; then
    if [ "$(id -u)" -ne 0 ]; then
        echo "install-spark: need ${missing[*]}; run as root or: sudo apt-get install ${missing[*]}" >&2
        exit 1
    fi
    echo "install-spark: installing ${missing[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    # An update only when the package lists do not know the package yet.
    if ! apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null 2>&1; then
        apt-get update -qq
        apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
    fi
fi

if [ ! -r "$JDBC_JAR" ]; then
    echo "install-spark: $JDBC_JAR is still missing after installing libpostgresql-jdbc-java" >&2
    exit 1
fi
echo "install-spark: java $(java -version 2>&1 | head -n 1 | cut -d'"' -f2), JDBC driver $JDBC_JAR"
