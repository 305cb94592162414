"""Reading ``--smol-results`` files back: statistics and views for people (issue 29).

Nothing here is imported at pytest start-up; the ``results`` subcommand imports it lazily.
"""
