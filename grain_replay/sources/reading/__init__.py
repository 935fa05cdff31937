"""The reading layer every format shares: leaf readers, chunk cache, decode pool, read-ahead."""
