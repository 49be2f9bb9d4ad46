#!/bin/bash
python3 -c '
import json
users = json.load(open("users.json"))
names = sorted(u["username"] for u in users if u.get("active") is True and str(u.get("last_login", "")).startswith("2024"))
open("active.txt", "w").write("".join(n + "\n" for n in names))
' && cat active.txt
