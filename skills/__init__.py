"""What is learned: skills (task bank + environment + rubric), the plugin registry, the nano base model."""
