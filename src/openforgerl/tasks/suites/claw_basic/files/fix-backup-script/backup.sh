#!/bin/sh
# Copy every note into backup/.
set -e
SOURCE_DIR=notes
mkdir -p backup
cp "$SOURCE_DIR"/*.md backup/
echo "backed up $(ls backup | wc -l) notes"
