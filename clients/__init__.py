"""Example clients for a running Harpoon server (curl scripts, the openai SDK, an interactive chat)."""
