//! The rules that keep an expansion's meaning independent of the user's names, as a check over
//! expanded code, and the list of the names an expansion keeps to itself.
//!
//! Generated code lives in the user's module, so every name it writes is looked up among the
//! user's items and imports first. The rules, which every expansion (`conv2d!` and everything the
//! macros emit later) follows:
//!
//! - Names private to the expansion (constants, statics, functions, types, generic parameters)
//!   start with `__`, which no user writes. Public items are the layer and the names derived from
//!   it (`<Layer>Grads`, `<Layer>State`, ...), and associated items, reached through their type.
//! - A constant passed as a generic argument is braced (`f::<{ __N }>`): a bare name is looked up
//!   as a type first, so a user's type of that name would win.
//! - Standard items are named by absolute paths (`::core::option::Option::Some`); nothing relies
//!   on the prelude (a user's `Some` or `Vec` would replace it). Macros likewise
//!   (`::core::debug_assert!`): a user's `macro_rules!` shadows the prelude's.
//! - `use` declarations start at `::`.
//!
//! Not covered, by Rust's naming conventions (rustc warns about code that breaks them): local
//! variables are lowercase words, so a user's lowercase constant or unit struct of the same name
//! would turn a `let` into a pattern (a compile error, never a silent change); primitive types are
//! named as such, so a user's type called `f32` or `usize` would shadow them.
//!
//! [`violations`] checks expanded code (the macro crate's unit tests run it over expansions of
//! every kernel family); [`private_names`] lists what the expansion defines for itself, which
//! tests/hygiene.rs (through `__hygiene_names!`) defines as hostile items around its layers.

use std::collections::BTreeSet;

use proc_macro2::TokenStream;
use syn::visit::{self, Visit};

/// Prelude items (types, traits, variants, functions) that generated code must never name bare.
const PRELUDE: &[&str] = &[
    "Option",
    "Some",
    "None",
    "Result",
    "Ok",
    "Err",
    "Vec",
    "Box",
    "String",
    "ToString",
    "ToOwned",
    "Default",
    "Clone",
    "Copy",
    "Send",
    "Sync",
    "Sized",
    "Unpin",
    "Drop",
    "Fn",
    "FnMut",
    "FnOnce",
    "Iterator",
    "IntoIterator",
    "DoubleEndedIterator",
    "ExactSizeIterator",
    "Extend",
    "FromIterator",
    "PartialEq",
    "Eq",
    "PartialOrd",
    "Ord",
    "AsRef",
    "AsMut",
    "From",
    "Into",
    "TryFrom",
    "TryInto",
    "drop",
    "std",
    "core",
    "alloc",
];

/// What one expansion defines and where it breaks the rules.
#[derive(Default)]
struct Scan {
    /// Every private name defined (items, generic parameters), with its `__`, and its kind.
    private: BTreeSet<(String, &'static str)>,
    /// Names defined as values (constants, statics, const parameters).
    values: BTreeSet<String>,
    /// Broken rules, each with the culprit.
    violations: Vec<String>,
    /// Names that may be defined without the prefix: the public items.
    public: BTreeSet<String>,
}

impl Scan {
    fn define(&mut self, kind: &'static str, ident: &syn::Ident) {
        let name = ident.to_string();
        if name == "_" || self.public.contains(&name) {
            return;
        }
        if name.starts_with("__") {
            self.private.insert((name, kind));
        } else {
            self.violations
                .push(format!("{kind} `{name}` is private but has no `__` prefix"));
        }
    }

    /// Items of a backend's `if_cuda! { .. }` / `if_onednn! { .. }` block, which `syn` sees as
    /// opaque tokens.
    fn nested_items(&mut self, mac: &syn::Macro) {
        let last = mac.path.segments.last().map(|s| s.ident.to_string());
        if matches!(last.as_deref(), Some("if_cuda" | "if_onednn")) {
            match syn::parse2::<syn::File>(mac.tokens.clone()) {
                Ok(file) => self.visit_file(&file),
                Err(e) => self.violations.push(format!("backend block: {e}")),
            }
        }
    }
}

impl<'ast> Visit<'ast> for Scan {
    fn visit_item(&mut self, item: &'ast syn::Item) {
        let defined = match item {
            syn::Item::Const(i) => Some(("constant", &i.ident)),
            syn::Item::Static(i) => Some(("static", &i.ident)),
            syn::Item::Fn(i) => Some(("function", &i.sig.ident)),
            syn::Item::Type(i) => Some(("type alias", &i.ident)),
            syn::Item::Struct(i) => Some(("struct", &i.ident)),
            syn::Item::Enum(i) => Some(("enum", &i.ident)),
            syn::Item::Trait(i) => Some(("trait", &i.ident)),
            syn::Item::Mod(i) => Some(("module", &i.ident)),
            syn::Item::Union(i) => Some(("union", &i.ident)),
            syn::Item::Macro(i) => i.ident.as_ref().map(|ident| ("macro", ident)),
            _ => None,
        };
        if let Some((kind, ident)) = defined {
            self.define(kind, ident);
        }
        if let syn::Item::Const(i) = item {
            self.values.insert(i.ident.to_string());
        }
        if let syn::Item::Static(i) = item {
            self.values.insert(i.ident.to_string());
        }
        visit::visit_item(self, item);
    }

    fn visit_item_use(&mut self, item: &'ast syn::ItemUse) {
        if item.leading_colon.is_none() {
            let tree = &item.tree;
            self.violations.push(format!(
                "`use {}` does not start at `::`",
                quote::quote!(#tree)
            ));
        }
    }

    fn visit_generic_param(&mut self, param: &'ast syn::GenericParam) {
        match param {
            syn::GenericParam::Type(p) => self.define("type parameter", &p.ident),
            syn::GenericParam::Const(p) => {
                self.define("const parameter", &p.ident);
                self.values.insert(p.ident.to_string());
            }
            syn::GenericParam::Lifetime(_) => {}
        }
        visit::visit_generic_param(self, param);
    }

    fn visit_path(&mut self, path: &'ast syn::Path) {
        if path.leading_colon.is_none() {
            if let Some(first) = path.segments.first() {
                let name = first.ident.to_string();
                if PRELUDE.contains(&name.as_str()) {
                    self.violations
                        .push(format!("`{name}` is named through the prelude"));
                }
            }
        }
        visit::visit_path(self, path);
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        if mac.path.leading_colon.is_none() {
            let path = &mac.path;
            self.violations.push(format!(
                "macro `{}!` is not named by an absolute path",
                quote::quote!(#path)
            ));
        }
        self.nested_items(mac);
    }

    fn visit_item_macro(&mut self, item: &'ast syn::ItemMacro) {
        // `macro_rules! name` is a definition, checked in `visit_item`.
        if item.ident.is_none() {
            self.visit_macro(&item.mac);
        }
    }
}

/// The arguments of every generic argument list that are a bare name of a value.
#[derive(Default)]
struct BareConsts<'a> {
    values: Option<&'a BTreeSet<String>>,
    found: Vec<String>,
}

impl<'ast> Visit<'ast> for BareConsts<'_> {
    fn visit_angle_bracketed_generic_arguments(
        &mut self,
        args: &'ast syn::AngleBracketedGenericArguments,
    ) {
        for arg in &args.args {
            if let syn::GenericArgument::Type(syn::Type::Path(p)) = arg {
                if let Some(ident) = p.path.get_ident() {
                    let name = ident.to_string();
                    if self.values.is_some_and(|v| v.contains(&name)) {
                        self.found.push(format!(
                            "constant `{name}` is a generic argument without braces"
                        ));
                    }
                }
            }
        }
        visit::visit_angle_bracketed_generic_arguments(self, args);
    }

    fn visit_macro(&mut self, mac: &'ast syn::Macro) {
        let last = mac.path.segments.last().map(|s| s.ident.to_string());
        if matches!(last.as_deref(), Some("if_cuda" | "if_onednn")) {
            if let Ok(file) = syn::parse2::<syn::File>(mac.tokens.clone()) {
                self.visit_file(&file);
            }
        }
    }
}

fn scan(expansion: TokenStream, public: &[String]) -> Scan {
    let mut scan = Scan {
        public: public.iter().cloned().collect(),
        ..Scan::default()
    };
    let file = match syn::parse2::<syn::File>(expansion) {
        Ok(file) => file,
        Err(e) => {
            scan.violations
                .push(format!("the expansion does not parse: {e}"));
            return scan;
        }
    };
    scan.visit_file(&file);
    let mut bare = BareConsts {
        values: Some(&scan.values),
        found: Vec::new(),
    };
    bare.visit_file(&file);
    scan.violations.extend(bare.found);
    scan
}

/// Every broken rule in `expansion`, whose public item names are `public`.
pub fn violations(expansion: TokenStream, public: &[String]) -> Vec<String> {
    let mut found = scan(expansion, public).violations;
    found.sort();
    found.dedup();
    found
}

/// The private names of expansions, without their `__` prefix, by the namespace they live in.
#[derive(Default)]
pub struct Names {
    /// Constants, statics and const parameters.
    pub values: BTreeSet<String>,
    pub functions: BTreeSet<String>,
    /// Types, traits, modules and type parameters.
    pub types: BTreeSet<String>,
}

impl Names {
    /// Adds the private names `expansion` defines.
    pub fn add(&mut self, expansion: TokenStream, public: &[String]) {
        for (name, kind) in scan(expansion, public).private {
            let bare = name.trim_start_matches('_').to_string();
            match kind {
                "constant" | "static" | "const parameter" => &mut self.values,
                "function" => &mut self.functions,
                _ => &mut self.types,
            }
            .insert(bare);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::expand;
    use crate::spec::{Activation, Dtype, Norm, Spec};

    /// Specs reaching every kernel family: direct (scattered and gathered input gradient, with
    /// and without padding), each Winograd variant, layers large enough for cuDNN; each in every
    /// element type, with every norm and activation between them.
    fn specs() -> Vec<Spec> {
        let shapes = [
            ([9, 7, 3], 5, 3, 2, 0, 2),
            ([8, 8, 3], 6, 3, 1, 1, 2),
            ([10, 10, 16], 16, 3, 1, 1, 2),
            ([7, 9, 16], 24, 3, 1, 0, 1),
            ([20, 20, 16], 32, 4, 2, 0, 2),
            ([16, 16, 16], 32, 3, 2, 1, 2),
            ([84, 84, 4], 32, 8, 4, 0, 32),
        ];
        let mut out = Vec::new();
        for (i, (input, oc, k, s, p, b)) in shapes.into_iter().enumerate() {
            for (j, (_, dtype)) in Dtype::ALL.into_iter().enumerate() {
                for (n, norm) in [
                    Norm::None,
                    Norm::BatchNorm {
                        momentum: 0.1,
                        eps: 1e-5,
                    },
                    Norm::LayerNorm { eps: 1e-5 },
                ]
                .into_iter()
                .enumerate()
                {
                    let mut spec = Spec::for_tests(input, oc, k, s, p, b);
                    spec.dtype = dtype;
                    spec.norm = norm;
                    spec.activation = Activation::ALL[(i + j + n) % Activation::ALL.len()].1;
                    out.push(spec);
                }
            }
        }
        out
    }

    #[test]
    fn every_expansion_keeps_the_rules() {
        for spec in specs() {
            let found = violations(expand::expand(&spec), &expand::public_names(&spec));
            assert!(
                found.is_empty(),
                "{:?} {:?} {:?} {:?}:\n{}",
                spec.input,
                spec.dtype,
                spec.norm,
                spec.activation,
                found.join("\n")
            );
        }
    }

    /// What an invalid spec still defines keeps the rules too.
    #[test]
    fn the_fallback_keeps_the_rules() {
        let spec = Spec::for_tests([8, 8, 3], 4, 3, 1, 0, 1);
        let fallback = expand::fallback(&spec.attrs, &spec.vis, &spec.ident);
        let found = violations(fallback, &expand::public_names(&spec));
        assert!(found.is_empty(), "{}", found.join("\n"));
    }

    #[test]
    fn the_checker_sees_each_rule_broken() {
        let public = ["Layer".to_string()];
        let broken = quote::quote! {
            pub struct Layer;
            const _: () = {
                const N: usize = 1;
                const __M: usize = 2;
                fn f<T, const __K: usize>(x: Option<usize>) -> Vec<f32> {
                    debug_assert!(true);
                    g::<__M>();
                    ::std::vec::Vec::new()
                }
                use std::mem;
            };
        };
        let found = violations(broken, &public);
        for expected in [
            "constant `N` is private",
            "function `f` is private",
            "type parameter `T` is private",
            "`Option` is named through the prelude",
            "`Vec` is named through the prelude",
            "macro `debug_assert!`",
            "constant `__M` is a generic argument without braces",
            "`use std :: mem` does not start at `::`",
        ] {
            assert!(
                found.iter().any(|f| f.contains(expected)),
                "{expected} not in {found:#?}"
            );
        }
        assert_eq!(found.len(), 8, "{found:#?}");
    }
}
