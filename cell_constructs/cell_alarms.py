"""Per-cell health alarms (issue 7): placeholder until it lands."""

CellAlarms = None
