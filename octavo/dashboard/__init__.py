"""The live dashboard's data: snapshots of paging, batching and caching, as plain data (pure Python)."""
