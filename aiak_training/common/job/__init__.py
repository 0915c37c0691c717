"""What aiakrun and its ranks share about a job: where each rank runs (``ranks``), the records
ranks leave for aiakrun (``records``) and the bounded exit with its notes (``exit_guard``)."""
