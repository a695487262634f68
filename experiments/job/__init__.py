"""The job's plumbing around the trainer: the config a job directory records (``jobdir``), the
command line's overrides (``overrides``), ``--list_experiments`` / ``--fdl_help`` (``info``) and
one-line error reports (``errors``)."""
