"""What a run reports: metrics and step lines, progress, profiling, diagnostics, routing statistics and plots."""
