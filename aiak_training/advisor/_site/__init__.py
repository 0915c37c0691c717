"""Not imported as a package: this folder goes on the ranks' PYTHONPATH during
``aiakrun --advise`` so that its ``sitecustomize`` runs.  The ``__init__`` only makes the
installers ship the folder."""
