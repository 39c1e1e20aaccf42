"""Images in prompts: what the engine carries (`inputs.py`) and how API content becomes it (`processor.py`)."""
