"""The time plan: every stage's predicted time, and the training images per epoch that fit the budget."""
