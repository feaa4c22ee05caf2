"""The profile stage: timed steps under torch.profiler (measure), the tuning trials and what they decide,
the bottleneck diagnosis, and the profile's JSON format and Markdown report."""
