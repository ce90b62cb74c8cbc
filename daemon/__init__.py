"""kvpoold: the resident daemon (engine, scheduler, model, server)."""
