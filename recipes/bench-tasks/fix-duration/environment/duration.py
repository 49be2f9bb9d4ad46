"""Parse durations such as '1h30m' or '90s' into seconds."""

import re

_PART = re.compile(r"(\d+)([hms])")
_SECONDS_PER_UNIT = {"h": 3600, "m": 3600, "s": 1}


def parse_duration(text):
    """Seconds in a duration written as a sequence of <number><unit> with units h, m, s."""
    text = text.strip()
    if not text or _PART.sub("", text):
        raise ValueError(f"not a duration: {text!r}")
    return sum(int(number) * _SECONDS_PER_UNIT[unit] for number, unit in _PART.findall(text))
