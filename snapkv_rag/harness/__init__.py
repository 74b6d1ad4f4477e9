"""Evaluation harness: task generators (needle, citation), runners, reports and plots."""
