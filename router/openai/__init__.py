"""The OpenAI surface on top of the PD core: `n` choices as parallel attempts (`fanout`), answers in OpenAI's shapes
(`openai_answer`), and the deprecated `functions` written back the legacy way (`legacy_functions`)."""
