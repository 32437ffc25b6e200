"""Runners execute the model forward: eager today; compiled and graph-captured runners plug in here."""
