#!/bin/bash
printf 'Hello, sandbox!\n' > greeting.txt
