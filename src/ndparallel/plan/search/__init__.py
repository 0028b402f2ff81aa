"""The search: what a request asks, which layouts are tried, each layout's options, the ranking,
and the longest sequence (``--max-seq-len``)."""
