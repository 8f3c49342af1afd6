"""Data: tokenizers, sources (text, JSONL, parallel files), built-in synthetic generators and the
pipelines that turn them into deterministic, resumable, per-process batches."""
