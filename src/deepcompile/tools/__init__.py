"""The `deepcompile` command and what it runs: the demo, the bench, the planner.

Nothing in the library imports this package; it imports the library like a user's program
does (tests/test_layering.py checks both).
"""
