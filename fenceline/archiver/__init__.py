"""The archiver: moves terminal jobs to cold tables."""
