"""Engine calls: one function per fl.* SQL function."""
