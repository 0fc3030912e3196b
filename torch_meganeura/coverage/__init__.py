"""The OpInfo sweep (``python -m torch_meganeura.coverage``, ``__main__``): the sweep (``sweep``), the resident
step's path (``step``), how a result is judged (``compare``), the JSON and markdown report (``report``).
"""
