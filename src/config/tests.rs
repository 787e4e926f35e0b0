use clap::Parser;

use super::*;

#[test]
fn sample_config_parses_and_matches_the_defaults() {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/readstates.toml");
    let sample = Config::resolve(Settings::from_file(&path).unwrap());
    assert_eq!(sample.to_toml(), Config::default().to_toml());
}

#[test]
fn flags_override_the_file() {
    let cli = Cli::try_parse_from([
        "readstates",
        "serve",
        "--write-delay",
        "2s",
        "--shards",
        "4",
    ])
    .unwrap();
    let Command::Serve(args) = cli.command else {
        panic!("serve")
    };
    let file: Settings = toml::from_str("write_delay = \"10s\"\ncache_capacity = 5").unwrap();
    let config = Config::resolve(args.settings.or(file));
    assert_eq!(config.write_delay, Duration::from_secs(2));
    assert_eq!(config.cache_capacity, 5);
    assert_eq!(config.shards, 4);
}

#[test]
fn the_password_is_never_shown() {
    let cli = Cli::try_parse_from([
        "readstates",
        "serve",
        "--cassandra-password",
        "hunter2",
        "--cassandra-nodes",
        "a:9042,b:9042",
        "--consistency",
        "LOCAL_ONE",
    ])
    .unwrap();
    let Command::Serve(args) = cli.command else {
        panic!("serve")
    };
    let config = Config::resolve(args.settings);
    assert_eq!(config.cassandra().password.as_deref(), Some("hunter2"));
    assert_eq!(config.cassandra_nodes, ["a:9042", "b:9042"]);
    assert_eq!(config.consistency, Consistency::LocalOne);
    assert!(!format!("{config:?}").contains("hunter2"));
    assert!(!config.to_toml().contains("hunter2"));
}

/// Case 9 of "Lossless at every transition": settings that cannot work
/// were accepted.
#[test]
fn settings_that_cannot_work_are_refused_with_the_reason() {
    // `readstates serve ARGS`, loaded: why it is refused, if it is.
    let load = |args: &[&str]| {
        let cli = ["readstates", "serve"].iter().chain(args);
        let Command::Serve(args) = Cli::try_parse_from(cli).unwrap().command else {
            panic!("serve")
        };
        Config::load(&args).map(|_| ()).map_err(|e| e.to_string())
    };
    let refused = |flag: &str, value: &str| load(&[flag, value]).unwrap_err();
    for level in ["ONE", "LOCAL_ONE"] {
        assert!(refused("--consistency", level).contains("LOCAL_QUORUM"));
    }
    for flag in [
        "--max-concurrent-requests",
        "--max-evicted-unwritten",
        "--flush-concurrency",
        "--shards",
        "--cache-capacity",
    ] {
        assert!(refused(flag, "0").contains("at least 1"), "{flag}");
    }
    assert!(refused("--shutdown-timeout", "0s").contains("give up"));
    // Issue 24, item 5: a URL or a space was taken as the address.
    for address in ["http://127.0.0.1:50051", "bad host:50051", "127.0.0.1"] {
        let node = [
            "--store",
            "cassandra",
            "--node-id",
            "n1",
            "--advertise",
            address,
        ];
        let refusal = load(&node).unwrap_err();
        assert!(
            refusal.contains(&format!("advertise {address:?} is not host:port")),
            "{refusal}"
        );
    }
    // Found by an adversarial review: a huge delay overflowed the clock
    // and panicked on the first change.
    assert!(refused("--write-delay", "9223372036854775807s").contains("at most 1day"));
    // Issue 35, item 1: a fleet node trusts only calls that carry the
    // fleet's token, so it needs the secret, and one worth the name.
    let node = |secret: Option<&str>| {
        let mut args = vec![
            "--store",
            "cassandra",
            "--node-id",
            "n1",
            "--advertise",
            "127.0.0.1:50051",
        ];
        args.extend(
            secret
                .map(|secret| ["--fleet-secret", secret])
                .into_iter()
                .flatten(),
        );
        load(&args)
    };
    assert!(node(None).unwrap_err().contains("needs fleet_secret"));
    assert!(
        node(Some("short"))
            .unwrap_err()
            .contains("at least 16 bytes")
    );
    assert_eq!(node(Some("sixteen bytes at least")), Ok(()));
    assert!(Config::default().check().is_ok());
}

/// Adding a setting means documenting it: the sample file and the
/// reference's table (docs/operations.md) name every flag `serve` takes.
#[test]
fn the_sample_file_and_the_operations_page_name_every_setting() {
    use clap::CommandFactory;
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let sample = std::fs::read_to_string(root.join("config/readstates.toml")).unwrap();
    let reference = std::fs::read_to_string(root.join("docs/operations.md")).unwrap();
    let cli = Cli::command();
    let serve = cli.find_subcommand("serve").unwrap();
    let flags: Vec<&str> = serve
        .get_arguments()
        .filter_map(|arg| arg.get_long())
        .filter(|flag| !matches!(*flag, "config" | "print-config"))
        .collect();
    assert!(flags.len() >= 20, "{flags:?}");
    for flag in flags {
        let key = flag.replace('-', "_");
        let in_sample = sample.lines().any(|line| {
            line.trim_start_matches("# ")
                .starts_with(&format!("{key} ="))
        });
        assert!(in_sample, "config/readstates.toml lacks {key}");
        assert!(
            reference.contains(&format!("`--{flag}`")),
            "docs/operations.md lacks --{flag}"
        );
    }
}

#[test]
fn unknown_keys_are_refused() {
    assert!(toml::from_str::<Settings>("write_dealy = \"1s\"").is_err());
}
