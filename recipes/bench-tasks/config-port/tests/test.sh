#!/bin/bash
# Pass iff app.ini is the original with only the [server] port changed to 8080.
set -u
cat > /tmp/expected.ini <<'INI'
; settings of the example application
[server]
host = 127.0.0.1
port = 8080
workers = 4

[database]
host = db.internal
port = 5432
name = inventory

[logging]
level = info
INI
diff -u /tmp/expected.ini app.ini && echo PASS
