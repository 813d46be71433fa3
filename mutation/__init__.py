"""Mutation testing of the guard core: ``python -m mutation`` (see ``mutation/runner.py``)."""
