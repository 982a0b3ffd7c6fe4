"""What a run needs to live and end well: stop signals, the run folder, safe writes, exit codes, GC, train state."""
