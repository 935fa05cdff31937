"""The on-disk contract writers and readers both import: metadata layout, format signatures,
checksums, durable replaces, a many-writer store's parts and row ids, commit watermarks and the
learners' published progress (the rate-limit rule both sides apply). Imports no source and no
writer."""
