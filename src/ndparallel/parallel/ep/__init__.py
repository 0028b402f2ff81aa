"""Expert parallelism on the ``ep`` mesh: ``expert`` splits each mixture-of-experts layer's experts
over the ranks, with an all-to-all dispatch and combine."""
