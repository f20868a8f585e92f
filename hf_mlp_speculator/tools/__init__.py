"""The command line's demo and benchmark, their runs and reports, and the offline default pair."""
