"""Models whose numerically sensitive parts run in fp32 ("fp32 islands")."""
