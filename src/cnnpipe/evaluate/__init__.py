"""Evaluate and compare: test-set predictions and their metrics, confidence intervals and paired tests,
the mistakes gallery, and the baseline-vs-optimized table."""
