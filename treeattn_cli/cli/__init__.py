"""The commands, as the launching process runs them: flags, prompts, preparation, presentation."""
