#!/bin/bash
awk '$3 == "ERROR"' /app/app.log | wc -l > /app/errors.txt
