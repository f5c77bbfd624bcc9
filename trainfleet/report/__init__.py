"""The run report: report.json, report.html and its plots as PNGs (files.py), the page (page.py)
and the charts drawn with matplotlib (charts.py). The Report function writes it to S3 at the end
of every run; `trainfleet run report` writes it to a folder at any time. It imports only the
core: a Lambda must not import the operator's side.
"""
