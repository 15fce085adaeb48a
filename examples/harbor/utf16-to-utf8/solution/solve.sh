#!/bin/bash
iconv -f UTF-16 -t UTF-8 /app/prices.csv > /app/prices-utf8.csv
