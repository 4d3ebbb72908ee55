"""AttnRes model family (Attention Residuals, arXiv 2603.15031): configuration, modeling and the op."""
