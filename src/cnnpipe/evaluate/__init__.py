"""Evaluate and compare: test-set predictions and their metrics, confidence intervals and paired tests,
the mistakes gallery, the baseline-vs-optimized table and the data of its charts (`dvc plots show`)."""
