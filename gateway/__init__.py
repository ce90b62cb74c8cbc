"""kvpool's OpenAI-compatible HTTP gateway: a separate process, a client of kvpoold over ZeroMQ.

Stateless HTTP clients that resend their whole conversation every turn get their earlier turns' KV back from
kvpoold's tiers: a conversation maps to a kvpool session, and each turn sends only its new tokens.
"""
