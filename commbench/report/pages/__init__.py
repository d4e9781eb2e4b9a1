"""The pages of a report folder: summary.md, report.html and the console tables."""
