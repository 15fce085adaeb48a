#!/bin/bash
wc -w < /app/poem.txt > /app/count.txt
