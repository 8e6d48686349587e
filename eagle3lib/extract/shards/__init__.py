"""The hidden-state shards of 01_extract (writer.py; split by concern in the next commit)."""

from eagle3lib.extract.shards.writer import *  # noqa: F403
