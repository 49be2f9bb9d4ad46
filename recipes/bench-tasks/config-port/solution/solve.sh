#!/bin/bash
# step: look at the file
cat app.ini
# step: change the port inside [server] only
sed -i '/^\[server\]/,/^\[/ s/^port = .*/port = 8080/' app.ini
