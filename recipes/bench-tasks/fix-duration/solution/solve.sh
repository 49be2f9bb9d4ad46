#!/bin/bash
# step: reproduce
python3 -c 'from duration import parse_duration; print(parse_duration("1h30m"))'
# step: minutes are 60 seconds
sed -i 's/"m": 3600/"m": 60/' duration.py && python3 -c 'from duration import parse_duration; print(parse_duration("1h30m"))'
