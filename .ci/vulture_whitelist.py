"""Names vulture reports as unused that a signature requires (read by `vulture`, never imported)."""

# signal handlers: signal.signal calls handler(signum, frame)
signum  # noqa: B018
frame  # noqa: B018
# html.parser.HTMLParser.handle_starttag(tag, attrs) is overridden with its signature
attrs  # noqa: B018
# transformers.Trainer's hooks, overridden with their signatures
dataloader  # noqa: B018
num_items_in_batch  # noqa: B018
# tqdm's set_postfix_str(s, refresh=True), wrapped with its signature
refresh  # noqa: B018
# pytest fixtures asked for their effect (the registries restored after the test)
isolated_registries  # noqa: B018
# sys.setprofile's callback(frame, event, arg); a monkeypatched function's signature (cfg_)
arg  # noqa: B018
cfg_  # noqa: B018
