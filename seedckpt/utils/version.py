"""The package version, recorded in every manifest."""

VERSION = "0.1.0"
