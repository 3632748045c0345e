"""OpenAI's Responses API (``/v1/responses``): each response runs as a chat completion (app/openai/chat/) and is
shown as output items, streamed as typed events, and stored per tenant in PostgreSQL until its retention ends."""
