"""What a run is given: its settings (run_config: the RunConfig;
settings_checks: the checks of its flags) and its text (data)."""
